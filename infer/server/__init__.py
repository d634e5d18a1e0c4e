"""`ntransformer serve`: an OpenAI-compatible HTTP server with continuous batching over the engine
(resident or streamed weights, GPU or CPU). See docs/SERVER.md."""
