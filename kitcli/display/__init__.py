"""What a user sees of a run: the live dashboard, alarms, the report and its SVG plots. Imports the stage-type
registry (recipe/), rewards' text helpers and the ground; never a stage module, training/, run/ or commands/."""
