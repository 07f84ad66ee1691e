-- Runs once, when the postgres data volume is first initialised (as POSTGRES_USER).
-- Two databases with their own owners: Dagster's instance storage, and persist's Consensus
-- (the `consensus` table is created by persist_lib on first use).
-- The passwords must match DAGSTER_POSTGRES_PASSWORD and PERSIST_CONSENSUS_URI in
-- docker/.env.example; after changing them here, recreate the volume (`down -v`).

CREATE ROLE dagster WITH LOGIN PASSWORD 'dagster';
CREATE DATABASE dagster OWNER dagster;

CREATE ROLE persist WITH LOGIN PASSWORD 'persist';
CREATE DATABASE persist OWNER persist;
