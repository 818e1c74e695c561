"""K recommendation (`peagle recommend-k`): the cost model (cost_model.py: expected tokens per step
and throughput from acceptance and step costs), the step timing (step_costs.py: draft and verify
forwards at every batch size and K) and the measuring, tables and heat map (measure.py)."""
