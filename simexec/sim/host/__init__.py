"""CPU ranks sharing a host's cores: the host model behind `simexec.sim.machine.SharedCoresMachine`."""
