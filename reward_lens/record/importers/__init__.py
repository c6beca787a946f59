"""Importers: convert what a framework leaves on disk into a reward-lens record."""
