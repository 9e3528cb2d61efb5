"""Test-only code shared by the tests and the GPU proof drivers (not part of the product)."""
