"""Test utilities: the fake accelerator and tiny random-weight pipelines."""
