"""Pure routing policy: estimates, scores with breakdowns, the dispatch plan and the gate. No I/O."""
