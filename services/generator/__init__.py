"""The generator service: job consumer, workflows, evolve search, coders and LLM agents
(docs/architecture.md, "The life of a job")."""
