"""Taps: write a reward-lens record while a trainer runs."""
