"""Test-session setup shared by every test module."""
