"""What a run writes and how it is read back: results.json and rounds.csv (`results`), the console lines
and progress, the summary, the plot, the convergence rule and the results page."""
