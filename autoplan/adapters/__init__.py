"""Thin adapters over private torch APIs: a torch upgrade should touch only these modules."""
