// Summarize a vitest JSON report of the conformance suite.
//
//   node summarize.mjs results/rsb.json                 counts + failed/skipped names
//   node summarize.mjs results/rsb.json --md            same, as markdown bullets
//   node summarize.mjs results/rsb.json --statuses      one "status<TAB>describe > test" line per test
//   node summarize.mjs results/rsb.json --compare baseline/reference-0.3.7-lp500ms.tsv
//        also lists the tests that PASS in the baseline but not in this run (the goal:
//        none). The baseline may be a vitest JSON report or a --statuses TSV.
// Exit status: 1 if any test failed (or, with --compare, if any baseline pass regressed).
import { readFileSync } from "node:fs"

const args = process.argv.slice(2)
const file = args.find((a) => !a.startsWith("--")) ?? "results/results.json"
const md = args.includes("--md")
const statusesOnly = args.includes("--statuses")
const cmpIdx = args.indexOf("--compare")
const cmpFile = cmpIdx >= 0 ? args[cmpIdx + 1] : null

// Test names without the harness's own outer describe, so reports from different
// wrappers (this harness, upstream's "In-Memory Server Implementation") compare equal.
const OUTER = new Set(["Durable Streams conformance", "In-Memory Server Implementation", "File-Backed Server Implementation"])

function load(path) {
  const text = readFileSync(path, "utf8")
  const map = new Map()
  if (path.endsWith(".tsv")) {
    for (const line of text.split("\n")) {
      if (!line.trim()) continue
      const [status, name] = line.split("\t")
      map.set(name, { status, msg: "" })
    }
    return map
  }
  const report = JSON.parse(text)
  for (const f of report.testResults ?? []) {
    for (const t of f.assertionResults ?? []) {
      const anc = (t.ancestorTitles ?? []).filter((a, i) => !(i === 0 && OUTER.has(a)))
      const name = [...anc, t.title].join(" > ")
      const status = t.status === "pending" ? "skipped" : t.status
      map.set(name, { status, msg: (t.failureMessages?.[0] ?? "").split("\n")[0] })
    }
  }
  return map
}

const run = load(file)
if (statusesOnly) {
  for (const [name, r] of run) console.log(`${r.status}\t${name}`)
  process.exit(0)
}

const counts = { total: 0, passed: 0, failed: 0, skipped: 0, todo: 0 }
const failed = []
const skipped = []
for (const [name, r] of run) {
  counts.total++
  if (r.status === "passed") counts.passed++
  else if (r.status === "failed") { counts.failed++; failed.push([name, r.msg]) }
  else if (r.status === "todo") counts.todo++
  else { counts.skipped++; skipped.push([name, r.status]) }
}
const b = md ? "- " : "  "
console.log(`total=${counts.total} passed=${counts.passed} failed=${counts.failed} skipped=${counts.skipped} todo=${counts.todo}`)
console.log(`\nFAILED (${failed.length}):`)
for (const [name, msg] of failed) console.log(`${b}${name}${md ? `\n  - \`${msg.slice(0, 200)}\`` : `\n      ${msg.slice(0, 200)}`}`)
console.log(`\nSKIPPED (${skipped.length}):`)
for (const [name, st] of skipped) console.log(`${b}${name} [${st}]`)

let regressions = 0
if (cmpFile) {
  const base = load(cmpFile)
  const lost = [...base].filter(([n, r]) => r.status === "passed" && run.get(n)?.status !== "passed")
  const gained = [...run].filter(([n, r]) => r.status === "passed" && base.get(n)?.status !== "passed")
  regressions = lost.length
  console.log(`\nCOMPARED WITH ${cmpFile}: baseline passes ${[...base.values()].filter((r) => r.status === "passed").length}; ` +
    `${lost.length} of them do not pass here; ${gained.length} pass here but not in the baseline`)
  for (const [n] of lost) console.log(`${b}NOT PASSING: ${n} [${run.get(n)?.status ?? "absent"}]`)
  for (const [n] of gained) console.log(`${b}extra pass: ${n}`)
}
process.exitCode = counts.failed > 0 || regressions > 0 ? 1 : 0
