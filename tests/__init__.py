"""SpaceServe tests: a package, so that tests/kernels is `tests.kernels` and never shadows the
`kernels` distribution transformers imports."""
