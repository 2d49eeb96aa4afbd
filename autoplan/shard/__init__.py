"""Stage 2, shard: the ways each traced node can be laid out over the device mesh (DTensor's sharding
rules expanded to N-D, autoplan's own where DTensor has none), the user's constraints on them, and
where the rows of a parameter that does not divide evenly lie. These strategies are the choices the
solver picks among, so every plan it can return is one DTensor can run."""
