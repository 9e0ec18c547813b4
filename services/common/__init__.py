"""What every service shares: settings, the NATS bus and its bootstrap, the job store
and job helpers, pull-consumer helpers, NATS users, the embedded nats-server, logging
and metrics (docs/architecture.md, "Where the code is")."""
