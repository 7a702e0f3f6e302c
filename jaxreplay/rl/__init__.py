"""Advantage estimators, off-policy policy-gradient losses and the jitted train step."""
