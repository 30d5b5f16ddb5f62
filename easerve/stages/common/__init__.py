"""What every stage process shares: config and flags, bootstrap, peers and placement calls, load reports, limits, metrics, warm-up."""
