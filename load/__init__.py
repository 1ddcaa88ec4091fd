"""Load tools: a simulated upstream embeddings API, load generators and benchmarks."""
