"""The GPU suite's machinery (benchmarks/gpu_suite.sh runs it), imported as ``benchmarks.gpu_suite.targets``
by bench_step.py and the tests; each module also runs as a script."""
