-- The raw-SQL recipe: a fence column on one of your own tables (here `orders`, keyed by its
-- primary key `id`). Replace `orders` by your table. BIGINT, since tokens are 64-bit; NOT NULL
-- DEFAULT 0 (nothing accepted yet) is a catalog-only change since PostgreSQL 11: no rewrite.
ALTER TABLE orders ADD COLUMN IF NOT EXISTS fence_token BIGINT NOT NULL DEFAULT 0;

-- Every protected write then carries the holder's token and the guard:
--   UPDATE orders SET total = $1, fence_token = $2 WHERE id = $3 AND fence_token <= $2;
-- One row updated: accepted. Zero rows: a newer token was accepted (or there is no such row;
-- `SELECT fence_token FROM orders WHERE id = $3` tells which). Never update the row elsewhere
-- without the guard, and never set fence_token to anything but the presented token.
