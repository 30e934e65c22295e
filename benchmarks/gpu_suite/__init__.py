"""The GPU suite's machinery (benchmarks/gpu_suite.sh runs it): a package so that bench_step.py and the tests
import its targets as ``gpu_suite.targets`` with benchmarks/ on sys.path; each module also runs as a script."""
