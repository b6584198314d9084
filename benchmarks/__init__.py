"""weighbridge benchmarks: ``python -m benchmarks [NAME ...] [--quick]`` (``make bench``).

A benchmark is a module here that defines ``BENCHMARK = Benchmark(...)`` (see
:mod:`benchmarks._core`). Every figure is a ratio against a baseline measured in the same run,
because the machines are shared and noisy; results go to ``benchmarks/RESULTS.md``.
"""
