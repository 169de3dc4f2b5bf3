"""Is it still the same training: ``records`` loads two run folders, ``tolerance`` says how far
two correct runs may drift apart, ``runs`` compares them step by step, ``report`` writes the table
and the plot."""
