"""The control surface: the CLI, the REST API (with its Kafka Connect compatibility), operations both use, metrics, the dev server, the config reference."""
