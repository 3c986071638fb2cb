"""CPU ranks sharing a host's cores: the host model the engine uses for `local` clusters."""
