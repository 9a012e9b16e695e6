"""What a user sees of a run: the live dashboard, alarms, the report and its SVG plots, how numbers and messages read.
May import: recipe/ (the stage-type registry), rewards/ (its text helpers), the ground."""
