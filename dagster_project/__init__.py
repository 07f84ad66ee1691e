"""The Dagster code location of the persist platform (``dagster_project.definitions``)."""
