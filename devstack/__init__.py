"""What tests, benchmarks, the soak and the demo run the product with; not part of the product."""
