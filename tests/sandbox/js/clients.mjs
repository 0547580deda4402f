// E2B's JS SDKs against `k3sys sandbox serve` (run by tests/sandbox/service/test_js_clients.py): `getHost`
// of `e2b`, and `runCode` of `@e2b/code-interpreter`. E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
// E2B_DOMAIN=localhost:<port> point them at the service; E2B_JS_MODULE and E2B_JS_CI_MODULE name the
// packages' ESM entries. Prints {host, urlHost, body, stdout, text} as JSON.
// Node does not resolve `*.localhost` on a host without nss-myhostname, so the request goes to the
// service's address with the URL's host in `Host`, as a browser or curl would send it.
import http from 'node:http'

const { Sandbox } = await import(process.env.E2B_JS_MODULE)
const { Sandbox: CodeInterpreter } = await import(process.env.E2B_JS_CI_MODULE)
const port = Number(new URL(process.env.E2B_API_URL).port)

function get(url) {
  return new Promise((resolve) => {
    const req = http.get({ host: '127.0.0.1', port, path: url.pathname, headers: { Host: url.host } }, (res) => {
      let body = ''
      res.on('data', (c) => (body += c))
      res.on('end', () => resolve(res.statusCode === 200 ? body : ''))
    })
    req.on('error', () => resolve(''))
  })
}

let out
const sbx = await Sandbox.create('base', { allowInternetAccess: false })
try {
  await sbx.files.write('/tmp/web/index.html', 'from js\n')
  await sbx.commands.run('cd /tmp/web && python3 -m http.server 8000', { background: true })
  const host = sbx.getHost(8000)
  const url = new URL(`http://${host}/index.html`) // the E2B_DOMAIN=127.0.0.1 throws here
  let body = ''
  for (const deadline = Date.now() + 30000; !body && Date.now() < deadline; ) {
    body = await get(url)
    if (!body) await new Promise((r) => setTimeout(r, 100))
  }
  out = { host, urlHost: url.host, body }
} finally {
  await sbx.kill()
}

const ci = await CodeInterpreter.create() // template: code-interpreter-v1, E2B's default
try {
  await ci.runCode('x = 6 * 7')
  const ex = await ci.runCode('print("js"); x') // the kernel kept x
  out.stdout = ex.logs.stdout
  out.text = ex.text
} finally {
  await ci.kill()
}
console.log(JSON.stringify(out))
