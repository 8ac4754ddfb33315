-- The meta store's database, next to Dagster's (POSTGRES_DB) in the same server.
CREATE DATABASE conveyor OWNER conveyor;
