"""Kernel demos and benchmarks: demo.py (`spaceserve demo`), cases.py (the shapes and budgets
the suite runs), suite.py (`spaceserve bench kernels`), plots.py (`bench plot-kernels`)."""
