"""The engine: request processing, the step loop, detokenization."""
