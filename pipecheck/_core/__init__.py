"""The base layer: what every layer below the faces may use (a step's result, torch's versions and warnings)."""
