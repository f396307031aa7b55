"""The scheduling simulator: the real router and its peers' policies on a simulated fleet, in
simulated time, beside the best fixed threshold and the lower bounds."""
