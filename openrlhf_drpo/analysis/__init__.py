"""drpo-analyze's engine: what an objective does to each token's gradient, derived with SymPy
(context, symbolic, settling, intervals, zeros), confirmed by a numeric arbiter (arbiter, events,
extremes, sampling, confirm) and stated as claims with their evidence (claims, admissibility,
alerts), held in one declared result (result) that the presentation renders (report, plot,
alert_text, mathtext). orchestrator.analyze is the entry point; budgets bounds the work."""
