"""One rank's lowering (`rank.RankLowering`), one module per concern; `simexec.program.lower` runs it
for every rank."""
