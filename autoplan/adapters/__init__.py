"""Thin adapters over private torch APIs: a torch upgrade should touch only these modules.

``tests/test_private_apis.py`` fails when a module outside this package names one.
"""
