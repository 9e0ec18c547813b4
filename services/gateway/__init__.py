"""The gateway service: the HTTP API, its SSE event stream and listings
(docs/architecture.md, "The life of a job")."""
