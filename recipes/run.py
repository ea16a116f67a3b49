"""Run any method or baseline by name.

    accelerate launch recipes/run.py --method fedbn --num_rounds 10
    accelerate launch recipes/run.py --config my_experiment.yaml
    python recipes/run.py --method ditto --help      # the method's own options are listed too
"""
from hfpfl.cli import run_recipe

def main(argv=None):
    return run_recipe(argv=argv, script=None if argv is None else "recipes/run.py")


if __name__ == "__main__":
    main()
