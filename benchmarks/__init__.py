"""The benchmark scripts (one per question) and their shared utilities, a package so that the tests
import what they check as ``benchmarks.traffic``, ``benchmarks.gpu_suite.targets``, ... (pytest's
``pythonpath = ["."]``). Each script also runs as ``python benchmarks/<script>.py``."""
