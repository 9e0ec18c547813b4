"""The worker service: verify consumer, sandboxed verifier, static and dynamic checks
(docs/architecture.md, "The life of a verify request"; docs/verification.md)."""
