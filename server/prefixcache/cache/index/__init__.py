"""What is known of pages besides the tree: the change log (sequence-numbered page
events), the page index by chained hash, page ids for lookup outcomes and a
distinct-count estimate.

Imports the shared tree parts (key, node, errors); never the tree kinds."""
