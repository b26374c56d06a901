"""Benchmarking speculative vs. standard decoding: datasets, an interleaved runner, reports and plots.

Used by ``specdecode bench``; the pieces are importable on their own:
``datasets.load_dataset``, ``runner.BenchRunner``, ``report.format_report``, ``plots.write_plots``.
"""
