"""The host adapters: OpenRLHF (hosts.openrlhf: ObjectiveLoss, the actor, drpo-train, CPU mode),
TRL (hosts.trl) and verl (hosts.verl). Each is thin: the language, the analysis and the loss
core (openrlhf_drpo.core) know no host."""
