"""The OpenAI-compatible HTTP server (`dsv4-serve`) over the runtime's Engine: tokenizers, chat
templates, the HTTP layer."""
