"""The connector loops' engine: the sink loop (read, transform, send, commit) and its collaborators, the source loop, stopping and liveness, failure decisions, routing and event-time watermarks."""
