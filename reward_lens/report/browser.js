// The rollout browser: filter by step and by reward, sort by a feature. Record text is only
// ever set with textContent (never parsed as HTML), so a completion holding markup stays text.
(function () {
  var data = JSON.parse(document.getElementById("browser-data").textContent);
  var body = document.getElementById("browser-rows");
  var count = document.getElementById("browser-count");
  var f = {
    stepMin: document.getElementById("browser-step-min"), stepMax: document.getElementById("browser-step-max"),
    rewardMin: document.getElementById("browser-reward-min"), sort: document.getElementById("browser-sort"),
    order: document.getElementById("browser-order")
  };
  data.features.forEach(function (ft) {
    var o = document.createElement("option");
    o.value = ft.name; o.textContent = ft.name + " (" + ft.unit + ")";
    f.sort.appendChild(o);
  });
  function num(el) { var v = parseFloat(el.value); return isNaN(v) ? null : v; }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    if (cls) { td.className = cls; }
    td.textContent = text;
    tr.appendChild(td);
  }
  function fmt(x) { return x === null || x === undefined ? "\u2014" : (Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(2) : +x.toPrecision(4) + ""); }
  function render() {
    var lo = num(f.stepMin), hi = num(f.stepMax), rmin = num(f.rewardMin), key = f.sort.value;
    var rows = data.rows.filter(function (r) {
      return (lo === null || r.step >= lo) && (hi === null || r.step <= hi) &&
        (rmin === null || (r.reward !== null && r.reward >= rmin));
    });
    if (key) {
      var sign = f.order.value === "asc" ? 1 : -1;
      rows.sort(function (a, b) {
        var x = a.features[key], y = b.features[key];
        if (x === undefined) { return 1; } if (y === undefined) { return -1; }
        return sign * (x - y);
      });
    }
    while (body.firstChild) { body.removeChild(body.firstChild); }
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      cell(tr, r.step, "num");
      cell(tr, r.prompt, "text");
      cell(tr, r.completion, "text");
      cell(tr, fmt(r.reward), "num");
      cell(tr, key ? fmt(r.features[key]) : "", "num");
      body.appendChild(tr);
    });
    count.textContent = rows.length + " of " + data.rows.length + " rollouts";
  }
  [f.stepMin, f.stepMax, f.rewardMin].forEach(function (el) { el.addEventListener("input", render); });
  [f.sort, f.order].forEach(function (el) { el.addEventListener("change", render); });
  document.getElementById("browser-filters").addEventListener("submit", function (e) { e.preventDefault(); });
  render();
})();
