"""The check layer: eager and float64 truths, numerics, comparison, localisation, the report and
`assert_equivalent`."""
