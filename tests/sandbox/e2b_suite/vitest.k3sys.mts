// E2B's JS SDK tests against `k3sys sandbox serve` (js_runner.py copies this file into the fetched
// packages/js-sdk and runs vitest with it). E2B's own vitest.config.mts, less the projects that need
// a browser (playwright) or Cloudflare's workers runtime: `unit`, `template` and `connectionConfig`
// with E2B's includes, excludes, timeouts and set-up file, unchanged. K3SYS_E2B_JS_EXCLUDE (paths,
// comma-separated) excludes more: js_runner.py's first pass leaves the msw-mocked files to its second.
import { defineConfig } from 'vitest/config'

const more = (process.env.K3SYS_E2B_JS_EXCLUDE ?? '').split(',').filter(Boolean)

const node = { globals: false, environment: 'node' as const, setupFiles: ['tests/globalFetchFallback.setup.ts'] }

export default defineConfig({
  test: {
    projects: [
      {
        test: {
          ...node,
          name: 'unit',
          include: ['tests/**/*.test.ts'],
          exclude: ['tests/runtimes/**', 'tests/template/**', 'tests/connectionConfig.test.ts', ...more],
          isolate: true,
          testTimeout: 30_000,
          bail: 0,
          deps: { interopDefault: true },
        },
      },
      { test: { ...node, name: 'template', include: ['tests/template/**/*.test.ts'], exclude: more, testTimeout: 180_000 } },
      {
        test: {
          globals: false,
          environment: 'node',
          name: 'connectionConfig',
          include: ['tests/connectionConfig.test.ts'],
          isolate: true,
          testTimeout: 10_000,
        },
      },
    ],
  },
})
