"""Who gets served, when and how often: priority admission and its queues (`admission`, `fair_queue`),
tenants and their budgets (`tenants`, `budgets`), and the retry budget (`retry_budget`). Above the routing
core (admission waits for the balancer's endpoints), below the serving layer."""
