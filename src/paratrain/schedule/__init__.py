"""Pipeline schedules as data: one IR, generators per family, validation."""
