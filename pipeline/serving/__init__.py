"""Serving a registered drafter: the MLflow pyfunc (`pyfunc`), the file it is logged as (`model_file`) and
`pipeline serve` (`server`)."""
