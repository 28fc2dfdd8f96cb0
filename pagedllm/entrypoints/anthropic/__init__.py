"""The Anthropic Messages API (/v1/messages), served over the chat completions request path."""
