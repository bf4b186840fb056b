"""Planted bugs: small pipeline runners, each correct but for ONE realistic bug, that the check must catch.

    python -m tests.mutants.table            # bug x zoo model -> caught, hint (a markdown table)
"""
