from phalanx.cli import run

run()
